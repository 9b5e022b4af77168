"""Client-side helpers for applications talking to a Stratum server."""
