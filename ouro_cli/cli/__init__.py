"""The `ouro` command line: one module per command; each parses, calls the core, prints."""
