"""`lodger ui`: the owner's page. A light server (FastAPI, no torch), its static files (uPlot
vendored, no build step, nothing fetched when the page loads) and one event stream per open page.
Its buttons act through the functions the commands use (``control``, the ledger, `lodger resume`)."""
