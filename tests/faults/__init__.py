"""Fault, overload and security tests: real stores, real processes."""
