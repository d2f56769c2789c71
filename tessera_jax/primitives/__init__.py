"""Tessera operators, one module per family. The public namespace is ``ts.op``."""
