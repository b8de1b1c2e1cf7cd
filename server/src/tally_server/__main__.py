"""``python -m tally_server``: the ``tally`` command of the server distribution."""

from tally_server.cli import main

main()
