"""The `torpor` command: one small module per subcommand, all logic in the library."""
