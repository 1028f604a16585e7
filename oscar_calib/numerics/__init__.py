"""Pure-torch numerics: Walsh–Hadamard and bit reversal (:mod:`.hadamard`), eigenbases and their
composition (:mod:`.rotation`), the INT2 and clip primitives every kernel is tested against
(:mod:`.quant`), and clip fitting on held-out rows (:mod:`.clip`)."""
