"""Thin click front end: parse, build a config, call one library function."""
