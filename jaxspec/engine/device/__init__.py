"""The engine's device side: the models and the family of compiled steps (``runner``), the batched state and every
operation on it (``executor``: the one seam the loop calls), the stored executables (``executables``) and their
preparation (``prepare``), measured step costs (``costs``), and the prefix cache's blocks (``prefix``)."""
