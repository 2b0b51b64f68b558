"""``python -m kvplug``: the same as the ``kvplug`` command."""

from kvplug.cli import main

main()
