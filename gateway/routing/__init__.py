"""A request's routing decision: admission, rendering and keys, candidates, tenants, adapters,
policies."""
