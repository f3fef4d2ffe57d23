"""The replicas behind the gateway: their ranks, names, health, load, parity and circuit breaker."""
