"""Recipes that reproduce the bundled demo pair: corpus, tokenizer, target, drafter, evaluation."""
