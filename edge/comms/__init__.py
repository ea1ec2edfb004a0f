"""MQTT v5 transport for the daemon and its clients."""
