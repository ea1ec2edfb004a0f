"""Retrieval builds: the document encoder, and the retrieval evaluation set."""
