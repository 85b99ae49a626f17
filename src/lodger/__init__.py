"""lodger: recoverable, reproducible, interruptible, accountable fine-tuning on machines people own."""

__version__ = "0.1.0"
