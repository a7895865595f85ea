"""The Typer layer of legorl: one module per subcommand; `main` is the table of contents."""
