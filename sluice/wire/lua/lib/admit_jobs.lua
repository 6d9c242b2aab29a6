-- admit(k, a, last): admit.lua's check and charge, over KEYS[k..] and ARGV[a..last] laid out as
-- admit.lua's header says from KEYS[1] and ARGV[1]; answers admit.lua's reply. admit.lua runs it
-- alone, admit_queue.lua before the write (`sluice.wire.broker.Broker.enqueue`).
--
-- KEYS: none of its own; admit.lua's four, from KEYS[k].
-- ARGV: none of its own; admit.lua's, from ARGV[a] to ARGV[last].

-- Takes `cost` tokens from the bucket at `key` (refilled at `rate` a second up to `burst`).
-- A cost above the burst needs a full bucket and leaves the rest as debt (tokens below zero),
-- which the refill pays before anything else passes. The bucket lives until it would be full
-- again, so that its expiry forgives no debt. Answers nil, or the seconds until there are enough;
-- a refusal leaves the bucket as it was.
local function take_tokens(key, rate, burst, now, cost)
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  local need = math.min(cost, burst)
  if tokens < need then return (need - tokens) / rate end
  tokens = tokens - cost
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((burst - tokens) / rate) + 1)
  return nil
end

-- The members of the set at `key` whose score (when they stop counting) is still ahead.
local function live_members(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end

-- Seconds until `over` of the answers stored at `key` have expired, or -1 if there are fewer.
local function stored_wait(key, over, now)
  local nth = redis.call('ZRANGE', key, over - 1, over - 1, 'WITHSCORES')
  if #nth == 0 then return -1 end
  return tonumber(nth[2]) - now
end

local function admit(k, a, last)
  local function key(i) return KEYS[k + i - 1] end
  local function arg(i) return ARGV[a + i - 1] end
  local now = tonumber(arg(1))
  if arg(6) ~= '' and redis.call('GET', key(4)) ~= arg(6) then return {'lost'} end
  local count = tonumber(arg(10))
  local first_hit = a + 10 + 2 * count
  local hits = (last - first_hit + 1) / 2
  if count + hits > 0 then
    local queued = live_members(key(1), now)
    if queued + count + hits > tonumber(arg(2)) then return {'quota', queued} end
  end
  if hits > 0 then
    local over = live_members(key(3), now) + hits - tonumber(arg(8))
    if over > 0 then return {'stored', tostring(stored_wait(key(3), over, now))} end
  end
  local cost = tonumber(arg(9))
  if cost > 0 then
    local wait = take_tokens(key(2), tonumber(arg(3)), tonumber(arg(4)), now, cost)
    if wait then return {'rate', tostring(wait)} end
  end
  if count > 0 then
    for i = a + 10, first_hit - 1, 2 do redis.call('ZADD', key(1), ARGV[i + 1], ARGV[i]) end
    redis.call('EXPIRE', key(1), arg(5))
  end
  if hits > 0 then
    for i = first_hit, last, 2 do redis.call('ZADD', key(3), ARGV[i + 1], ARGV[i]) end
    redis.call('EXPIRE', key(3), arg(5))
  end
  if arg(6) ~= '' then redis.call('PEXPIRE', key(4), arg(7)) end
  return {'ok'}
end
