"""The composition root: the command line, the one-machine launcher and the embedded stores.

It sits above every part (`api`, `workers`, `scheduler`) and the kernel (`sluice`), and nothing
imports it but its own entry points and the tests.
"""
