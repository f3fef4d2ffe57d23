"""The replicas behind the gateway: their ranks, health, load, parity and circuit breaker."""
