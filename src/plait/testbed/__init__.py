"""plait testbed: a multi-host cluster on one machine, from network namespaces with
shaped links (``spec``: what it is made of; ``netns``: building and removing it)."""
