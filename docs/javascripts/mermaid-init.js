// The diagrams (```mermaid fences) are drawn by the theme, Material for MkDocs, which uses the `mermaid` loaded just
// before this file (javascripts/mermaid.min.js, shipped with the site) instead of fetching one from unpkg.com, and
// initializes it with its own colours when a page has a diagram. Mermaid alone would also draw every `.mermaid`
// element once the page has loaded; this leaves the drawing to the theme, whichever runs first.
mermaid.initialize({ startOnLoad: false });
