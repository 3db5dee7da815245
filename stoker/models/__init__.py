"""Model families, one file each, built from `stoker.layers`. See registry.py."""
