"""Infrastructure every job shares (configuration first); imports no other package of the project."""
