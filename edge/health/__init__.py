"""Health reporting: status socket, monitoring check, systemd notifications."""
