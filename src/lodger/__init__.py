"""lodger: recoverable, reproducible, interruptible, accountable fine-tuning on machines people own."""

import logging as _logging

__version__ = "0.1.0"

# peft imports bitsandbytes whenever it is installed, and bitsandbytes then asks the `kernels` package
# for a kernel from the hub, which fails offline with two warnings in every process that imports peft.
# lodger never uses that kernel (quant.py keeps 4-bit layers on their fp32 path): docs/qlora.md.
for _name in ("bitsandbytes", "kernels"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
