"""The version of gpumem, in a module that imports nothing.

Its own module so that code inside the package can read it without importing the root
``gpumem/__init__.py``, which names every subpackage (an import circle for its own modules).
pyproject.toml reads it (``[tool.setuptools.dynamic]``); ``csrc/module.cpp`` states it for the
native core, and a test keeps the two in step.
"""

__version__ = "0.1.0"
