"""Model adapters: how each model kind is loaded, exported and fed."""
