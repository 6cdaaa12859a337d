"""`python -m opd.cli`: the opd command."""
from opd.cli import run

run()
