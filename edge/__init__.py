"""edge: an inference daemon for embedded boxes (OCR, inspection and Q&A over MQTT v5)."""

__version__ = "0.1.0"
