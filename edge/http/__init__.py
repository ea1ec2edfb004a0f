"""The OpenAI-compatible HTTP API (docs/http.md): requests become jobs through the same
intake, queue, journal and responder as MQTT messages."""
