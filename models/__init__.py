"""The networks and the files that hold them (docs/design.md, "Layout")."""
