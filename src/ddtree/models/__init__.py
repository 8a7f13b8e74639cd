"""Targets and drafters behind two small protocols (see ``ddtree.models.base``)."""
