"""The chat page served at ``/`` (docs/webui.md): its files in ``static/`` (hand-written ES modules and CSS, and
the vendored Markdown renderer, sanitizer and highlighter), and `serving`, which serves them under content-hashed
names, gzip-compressed, with a strict Content-Security-Policy."""
