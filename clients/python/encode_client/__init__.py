"""encode-server client."""
