"""Request-plane messages and client. Torch-free: the gateway imports this."""
