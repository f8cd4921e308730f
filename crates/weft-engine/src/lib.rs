//! TransferEngine: DomainGroups, ImmCounter, sharding and peer groups over any weft backend
