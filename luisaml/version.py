"""The luisaml version (here, not in __init__: the artifact records it without importing the package above it)."""
__version__ = "0.1.0"
