"""The `lodger` command: one module per command group. Only this package formats errors."""
