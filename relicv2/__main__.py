"""`python -m relicv2`: the `relicv2` command."""

from relicv2.cli.main import main

main()
