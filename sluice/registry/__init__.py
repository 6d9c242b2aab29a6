"""The Postgres registry: versions, routing, pins, tenants and keys, audit, quality."""
