"""The box's own documents: text read from files, cut into chunks with stable ids, and
kept in collections under the state directory."""
