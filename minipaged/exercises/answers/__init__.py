"""Reference answers of the build track's components, one module per lesson."""
