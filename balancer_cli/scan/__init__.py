"""Scanning datasets into lengths tables: readers, image headers, vision-token rules, tokenizers."""
