"""Checkpoints: the container format, the data tree (registry, encoder, decoder), the
public ``dump``/``load`` functions and the checkpoint manager. Private: the public names are
re-exported by :mod:`coax_utils.utils`."""
