-- job_changed(channel, id, status): announce a job's new status on the events channel.
--
-- KEYS: none (PUBLISH names a channel, not a key).
-- ARGV: none of its own; `channel` is the calling script's events channel argument.
--
-- The Lua twin of `sluice.wire.events.encode` for a JobChanged: the scripts that change a job's
-- state announce it in the same atomic step as the state they write.
local function job_changed(channel, id, status)
  redis.call('PUBLISH', channel, cjson.encode({type='job', id=id, status=status}))
end
