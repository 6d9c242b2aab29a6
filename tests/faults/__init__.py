"""Fault, overload and security tests (issue 3): real stores, real processes."""
