"""What a failed check does under the policy in force (observe, guard, strict): the
process's policy and sinks, the request-scoped degrade actions, the fatal record."""
