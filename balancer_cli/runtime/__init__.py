"""PyTorch runtime of balancer_cli (needs the ``torch`` extra): manifest replay and dispatch.

Import submodules directly (``balancer_cli.runtime.dispatch``) so that only what is used loads.
"""
