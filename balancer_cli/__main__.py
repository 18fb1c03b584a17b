"""``python -m balancer_cli`` runs the ``balancer`` command line."""

from balancer_cli.cli import run

if __name__ == "__main__":
    run()
