"""Writing files safely: atomic artifact writes, and output locations checked up front."""
