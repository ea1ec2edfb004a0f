"""The profile: its schema, one module a concern, and its loader.

base (StrictModel and shared types), broker, vision, text, service, profile (the whole
`Profile`), loader (`load_profile`, `parse_profile`, `ProfileError`). Nothing is
re-exported here, so that importing one section (edge.config.text, say) does not import
the whole profile.
"""
