"""``kpng top``: one node's Services by new connections per second, read from its ``/metrics``.

``ranking.py`` is pure: scrapes in, the rows of the view out (rates, resets, sorting).
``kpng.scraping``, shared with ``kpng explain``, fetches a page over HTTP, bounded, and turns it
into a scrape. ``command.py`` is the command: its flags, the live terminal view and the
``--once`` table. Nothing here is imported by kpng's other commands: ``kpng --help`` does not
pay for it.
"""
