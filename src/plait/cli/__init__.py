"""The `plait` command line: one module per subcommand (see plait.cli.main)."""
