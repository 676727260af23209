"""Migration scripts, oldest first: 0001 creates every table; later ones change them."""
