"""The device-side decoding core: token trees, sampling, verification, the speculators' drafting, the one step."""
