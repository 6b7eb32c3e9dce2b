"""Model card templates, installed as ``rlvr_lightning.hub_cards``."""
